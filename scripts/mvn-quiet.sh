# Sourced by the scripts that resolve jars with Maven. Debian's Maven writes colour resets (ESC[0m) even in batch
# mode and with -q; mvn_quiet runs it quietly and strips them, so its output is plain text, and its exit status stays
# Maven's (the sourcing scripts set pipefail). --strict-checksums: a jar whose checksum does not match the one Maven
# Central publishes fails the install (Maven's default only warns).
mvn_quiet() {
    mvn -q -B --strict-checksums "$@" 2>&1 | sed -E 's/\x1b\[[0-9;]*m//g'
}
