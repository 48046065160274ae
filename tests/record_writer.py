"""Another process that writes a host record through its own connection.

    python -m tests.record_writer RECORD_PATH LOG_PATH
        writes learnings as fast as it can (for kill tests); each committed write is then
        appended to LOG_PATH, so the test knows what must survive
    python -m tests.record_writer drift RECORD_PATH FINGERPRINT REVISION BACKEND WORKER
        records one drift event for that scope, as a worker's shadow does, seen by WORKER on
        one row of 20 padded tokens, and prints its ``created_at``
"""

from __future__ import annotations

import sys
import time
import uuid

from vllm_srun.records.host_record import DriftEvent, HostRecord, Scope


def write_learnings(record_path: str, log_path: str) -> None:
    record = HostRecord(record_path)
    scope = Scope("host", f"rev-{uuid.uuid4().hex}", "onnxruntime")
    with open(log_path, "a") as log:
        for i in range(1_000_000):
            record.add_samples(scope, 8, 1 + i % 2, [float(i)])
            record.put_learned(scope, 16, 2, 1.5, i)
            log.write(f"{scope.revision} {i}\n")
            log.flush()


def write_drift(record_path: str, fingerprint: str, revision: str, backend: str,
                worker: str) -> None:
    event = DriftEvent(padded_tokens=20, served_threads=2, shadow_threads=1, first_index=(0, 3),
                       served_value=0.25, shadow_value=0.2500001, created_at=time.time(), rows=1,
                       worker=worker)
    HostRecord(record_path).record_drift(Scope(fingerprint, revision, backend), event)
    print(event.created_at, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "drift":
        write_drift(*sys.argv[2:7])
    else:
        write_learnings(sys.argv[1], sys.argv[2])
