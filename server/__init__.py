"""The HTTP front end and command line of vllm-srun."""
