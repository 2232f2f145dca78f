"""Scaling recipes: the Chinchilla compute-optimal split, μP and its coordinate check."""
