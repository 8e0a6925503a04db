"""`python -m minivllm ...`: the `minivllm` command."""

from minivllm.frontend.cli import main

if __name__ == "__main__":
    main()
