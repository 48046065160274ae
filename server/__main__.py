"""``python -m vllm_srun.server ...`` is ``vllm-srun ...``."""

from vllm_srun.server.frontend.cli import main

raise SystemExit(main())
