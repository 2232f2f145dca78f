"""Parallelism applied from outside the model: mesh (dims), TP/SP, FSDP, PP, CP, global grad clipping."""
