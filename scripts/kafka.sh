#!/usr/bin/env bash
# A single Apache Kafka broker in KRaft mode (broker and controller in one JVM) on 127.0.0.1, for
# tests and benchmarks. Jars: scripts/ensure-kafka.sh (make install).
#
#   scripts/kafka.sh start --dir DIR --port PORT [--controller-port P] [--node-id N] [--heap-mb M]
#                          [--voters N@HOST:PORT,...] [--cluster-id ID] [--replication R]
#                          [--profile test|standard]
#       formats DIR on first use, starts the broker, returns once it serves clients (exit 1 if not
#       within KAFKA_START_TIMEOUT_S, default 180, with the log's tail on stderr). A cluster of
#       several: one start per node, all at once (each waits for the quorum), the same --voters
#       and --cluster-id; --replication R sets the internal topics' replication factor and
#       min.insync.replicas (R - 1, at least 1) for topics and the transaction log.
#       --profile test (the default): a small heap, the serial collector, no C2 JIT and two threads
#       of each kind, no idle no-op records in the metadata log, to start and idle lightly beside the
#       test suite's other JVMs; standard: what the Kafka distribution's own start script and
#       server defaults use (1 GiB heap, G1, the full JIT, 3 network and 8 I/O threads), for
#       benchmarks, where a peer's rate must not be the broker's (--heap-mb is ignored there).
#   scripts/kafka.sh stop --dir DIR [--kill]
#       SIGTERM (controlled shutdown) and wait; --kill: SIGKILL, as a crash
#
# Class-data sharing (--profile test): the JVMs map the classes an earlier broker loaded from one archive
# next to the jars, instead of reading and verifying them from 46 jars on every start. The first broker
# that finds no archive for this java and these jars writes one as it exits (-XX:ArchiveClassesAtExit,
# into its own dir); `stop` moves it into place with a rename, so brokers starting meanwhile never map a
# half-written file. The archive's name carries a checksum of the java binary and the jar listing: a new
# JDK or new jars simply make a new one. KAFKA_CDS=0 turns it off.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
LIBS="${KAFKA_LIBS:-$HERE/../var/kafka/libs}"
cmd="${1:-}"
shift || true
dir="" port="" cport="" node_id=1 heap_mb=384 kill=0 voters="" cluster_id="" replication=1 profile=test
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) dir="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --controller-port) cport="$2"; shift 2 ;;
        --node-id) node_id="$2"; shift 2 ;;
        --heap-mb) heap_mb="$2"; shift 2 ;;
        --kill) kill=1; shift ;;
        --voters) voters="$2"; shift 2 ;;
        --cluster-id) cluster_id="$2"; shift 2 ;;
        --replication) replication="$2"; shift 2 ;;
        --profile) profile="$2"; shift 2 ;;
        *) echo "kafka.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -n "$dir" ] || { echo "kafka.sh: --dir is required" >&2; exit 2; }
case "$profile" in
    test|standard) ;;
    *) echo "kafka.sh: --profile must be test or standard, not '$profile'" >&2; exit 2 ;;
esac
pidfile="$dir/kafka.pid"
# What a JVM needs to map an archive: the same java build and the same jars (their names, sizes and times).
cds_key="$({ (ls -l --time-style=+%s "$(readlink -f "$(command -v java)")" "$LIBS") 2>/dev/null || true; } | cksum | cut -d' ' -f1)"
archive="$LIBS/../cds-$cds_key.jsa"

alive() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

case "$cmd" in
start)
    [ -n "$port" ] || { echo "kafka.sh: --port is required" >&2; exit 2; }
    [ -n "$cport" ] || cport=$((port + 1))
    [ -n "$voters" ] || voters="$node_id@127.0.0.1:$cport"
    min_isr=$((replication > 1 ? replication - 1 : 1))
    [ -d "$LIBS" ] || { echo "kafka.sh: $LIBS missing: run scripts/ensure-kafka.sh (make install)" >&2; exit 1; }
    if alive; then echo "kafka.sh: a broker already runs for $dir (pid $(cat "$pidfile"))" >&2; exit 1; fi
    mkdir -p "$dir/data"
    dir="$(cd "$dir" && pwd)"
    pidfile="$dir/kafka.pid"
    cat > "$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=$node_id
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
offsets.topic.replication.factor=$replication
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$replication
transaction.state.log.min.isr=$min_isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$replication
share.coordinator.state.topic.min.isr=$min_isr
min.insync.replicas=$min_isr
default.replication.factor=$replication
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPS
    if [ "$profile" = test ]; then
        printf 'num.network.threads=2\nnum.io.threads=2\nbackground.threads=2\nmetadata.max.idle.interval.ms=0\n' >> "$dir/server.properties"
    fi
    cat > "$dir/log4j2.properties" <<PROPS
rootLogger.level=INFO
rootLogger.appenderRef.file.ref=file
appender.file.type=File
appender.file.name=file
appender.file.fileName=$dir/server.log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=[%d] %p %m (%c)%n
PROPS
    export CLASSPATH="$LIBS/*"
    if [ "$profile" = test ]; then
        jvm=(-Xms64m "-Xmx${heap_mb}m" -XX:+UseSerialGC -XX:TieredStopAtLevel=1)
    else
        jvm=(-Xms1g -Xmx1g -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35
             -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15)
    fi
    jvm+=(-Djava.awt.headless=true "-Dlog4j2.configurationFile=$dir/log4j2.properties")
    broker_jvm=("${jvm[@]}")
    rm -f "$dir/cds.jsa.new"
    if [ "$profile" = test ] && [ "${KAFKA_CDS:-1}" != 0 ]; then
        if [ -f "$archive" ]; then
            jvm+=("-XX:SharedArchiveFile=$archive")
            broker_jvm=("${jvm[@]}")
        else
            broker_jvm+=("-XX:ArchiveClassesAtExit=$dir/cds.jsa.new")
        fi
    fi
    if [ ! -f "$dir/data/meta.properties" ]; then
        # A cluster id is 16 random bytes in unpadded URL-safe base64 (what StorageTool random-uuid prints);
        # made here rather than by a JVM of its own on every first start. Kafka refuses ids that begin with '-'.
        while [ -z "$cluster_id" ] || [ "${cluster_id:0:1}" = - ]; do
            cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | cut -c 1-22)"
        done
        java "${jvm[@]}" kafka.tools.StorageTool format -t "$cluster_id" -c "$dir/server.properties" \
            >"$dir/format.log" 2>&1 || { cat "$dir/format.log" >&2; exit 1; }
    fi
    : >"$dir/server.log"
    nohup java "${broker_jvm[@]}" kafka.Kafka "$dir/server.properties" >"$dir/stdout.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    deadline=$((SECONDS + ${KAFKA_START_TIMEOUT_S:-180}))
    while :; do
        if ! alive; then
            echo "kafka.sh: the broker for $dir exited during start" >&2
            tail -n 30 "$dir/stdout.log" "$dir/server.log" >&2 || true
            exit 1
        fi
        if grep -q "Kafka Server started" "$dir/server.log" 2>/dev/null \
            && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            exit 0
        fi
        if [ $SECONDS -ge $deadline ]; then
            echo "kafka.sh: the broker for $dir did not start in time" >&2
            tail -n 30 "$dir/server.log" >&2 || true
            exit 1
        fi
        sleep 0.2
    done
    ;;
stop)
    if ! alive; then rm -f "$pidfile"; exit 0; fi
    pid="$(cat "$pidfile")"
    if [ "$kill" = 1 ]; then
        kill -KILL "$pid"
    else
        kill -TERM "$pid"
    fi
    deadline=$((SECONDS + 120))
    while kill -0 "$pid" 2>/dev/null; do
        if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; kill=1; fi
        sleep 0.2
    done
    rm -f "$pidfile"
    # A broker that exited on its own wrote its whole archive; a killed one may have left part of one.
    if [ -f "$dir/cds.jsa.new" ]; then
        if [ "$kill" = 0 ] && [ ! -f "$archive" ]; then mv -f "$dir/cds.jsa.new" "$archive"; else rm -f "$dir/cds.jsa.new"; fi
    fi
    ;;
*)
    echo "usage: kafka.sh start --dir DIR --port PORT | stop --dir DIR [--kill]" >&2
    exit 2
    ;;
esac
