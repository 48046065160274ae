"""A process that writes learnings into a host record as fast as it can (for kill tests).

Usage: python -m tests.record_writer RECORD_PATH LOG_PATH
Each committed write is then appended to LOG_PATH, so the test knows what must survive.
"""

from __future__ import annotations

import sys
import uuid

from vllm_srun.records.host_record import HostRecord, Scope

if __name__ == "__main__":
    record = HostRecord(sys.argv[1])
    scope = Scope("host", f"rev-{uuid.uuid4().hex}", "onnxruntime")
    with open(sys.argv[2], "a") as log:
        for i in range(1_000_000):
            record.add_samples(scope, 8, 1 + i % 2, [float(i)])
            record.put_learned(scope, 16, 2, 1.5, i)
            log.write(f"{scope.revision} {i}\n")
            log.flush()
