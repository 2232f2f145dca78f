"""Experiment tracking: a run's metrics, events, config and identity in the trackers a team already
watches (TensorBoard, MLflow, Weights & Biases), logged once per step from the supervisor, off the
training path, resumed into the same tracker run after ``--resume`` or a restart (``docs/tracking.md``)."""
