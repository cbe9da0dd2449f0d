"""Training: the run config, data and corpus preparation, the trainer, evaluation and
checkpoints. Imports the models, never the CLI, export or diagnostics."""
