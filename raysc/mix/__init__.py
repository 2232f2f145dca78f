"""Domain mixtures tuned on evidence (``raysc mix tune``): proxy runs on sampled mixtures, a
regression of the target domain's held-out loss on the mixture (RegMix), the mixture it predicts
best as a ``data.schedule`` fragment, and a validation run against the natural proportions.

``proposals`` draws mixtures and writes schedules, ``regression`` fits and searches, ``proxies``
trains and scores runs on the cluster, ``tune`` puts them together, ``plot`` draws the PNG,
``command`` is the CLI row."""
