"""Scaling recipes: the Chinchilla compute-optimal split, μP's coordinate check and LR transfer
(the μP rules themselves are part of the model: ``raysc.model.mup``)."""
