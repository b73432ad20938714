"""`python -m llmcompress ...` (also what torchrun runs: `torchrun ... -m llmcompress distill ...`)."""

from llmcompress.cli import main

main()
