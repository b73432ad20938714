"""Compressed collectives over torch.distributed (ZipCCL payloads), a DDP hook and an adaptive strategy.

Import the pieces from `llmcompress.comm.collectives`; this package module stays light.
"""
