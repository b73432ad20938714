"""Evaluation: perplexity, lm-evaluation-harness tasks, size and speed, reports."""
