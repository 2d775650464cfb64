"""Write a class-data-sharing archive of the Spark driver JVM for the test suite (make test).

Every test that runs the lake starts a Spark driver (the test workers, the daemons, each ``cdcd lake``
command): tens of JVMs that each load and link the same thousands of Spark, Scala and Delta classes.
A dynamic CDS archive (JDK 13+) holds those classes already parsed, and every JVM started with
``-XX:SharedArchiveFile`` maps it instead. This script starts one driver the way pyspark starts them
(``SPARK_SUBMIT_OPTS`` reaches the driver, not Spark's launcher JVM), runs the Delta operations the
lake runs, and has the driver dump every class it loaded (the ``VM.cds dynamic_dump`` diagnostic
command, called in the driver through its MBean: a JRE has no jcmd).

    python scripts/spark_cds.py OUT.jsa

make test writes it to .venv/spark-driver.jsa, where tests/conftest.py looks for it. An archive
that no longer fits the JVM or its classpath (pyspark upgraded, another JDK) is refused by the JVM
with a warning on stderr, and the tests run without it, slower.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# -XX:+RecordDynamicDumpInfo lets a running JVM dump. Bytecode verification stays on here: a JVM refuses
# an archive dumped with less verification than its own, and the tests' JVMs verify less.
os.environ["SPARK_SUBMIT_OPTS"] = "-XX:+RecordDynamicDumpInfo"


def main(out: Path) -> None:
    import pyarrow as pa

    from cdcd.lake import spark as spark_session

    session = spark_session.acquire("local[2]", "cdcd-cds", {"spark.sql.shuffle.partitions": "2"})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            table = f"delta.`{tmp}/t`"
            session.range(1000).selectExpr("id", "id % 7 AS k", "CAST(id AS STRING) AS v").write.format(
                "delta"
            ).partitionBy("k").save(f"{tmp}/t")
            source = "SELECT id, id % 7 AS k, 'x' AS v FROM range(500, 1500)"
            merge = "ON t.id = s.id WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
            session.sql(f"MERGE INTO {table} t USING ({source}) s {merge}")
            session.sql(f"DELETE FROM {table} WHERE id < 10")  # noqa: S608 - a temporary dir of ours
            session.sql(f"OPTIMIZE {table}")
            session.sql(f"DESCRIBE HISTORY {table}").collect()
            session.read.format("delta").option("versionAsOf", 1).load(f"{tmp}/t").collect()
            rows = pa.table({"id": pa.array(range(100), pa.int64()), "v": pa.array([str(i) for i in range(100)])})
            session.createDataFrame(rows).write.format("delta").mode("append").save(f"{tmp}/a")
            session.sql(f"SELECT k, count(*) FROM {table} GROUP BY k ORDER BY k").collect()  # noqa: S608
            gateway = session.sparkContext._gateway
            jvm = session._jvm
            args = gateway.new_array(jvm.java.lang.String, 2)
            args[0], args[1] = "dynamic_dump", str(out)
            signature = gateway.new_array(jvm.java.lang.String, 1)
            signature[0] = "[Ljava.lang.String;"
            params = gateway.new_array(jvm.java.lang.Object, 1)
            params[0] = args
            # Through the MBeanServer interface's Method: py4j looks methods up on the platform server's own
            # class, which java.management does not export.
            server = jvm.java.lang.management.ManagementFactory.getPlatformMBeanServer()
            name = jvm.javax.management.ObjectName("com.sun.management:type=DiagnosticCommand")
            cls = jvm.java.lang.Class.forName
            types = gateway.new_array(jvm.java.lang.Class, 4)
            for i, t in enumerate(
                ["javax.management.ObjectName", "java.lang.String", "[Ljava.lang.Object;", "[Ljava.lang.String;"]
            ):
                types[i] = cls(t)
            invoke = cls("javax.management.MBeanServer").getMethod("invoke", types)
            call = gateway.new_array(jvm.java.lang.Object, 4)
            call[0], call[1], call[2], call[3] = name, "vmCds", params, signature
            invoke.invoke(server, call)
    finally:
        spark_session.release()
    if not out.is_file():
        sys.exit(f"spark_cds: {out}: the driver wrote no archive")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/spark_cds.py OUT.jsa")
    main(Path(sys.argv[1]).resolve())
