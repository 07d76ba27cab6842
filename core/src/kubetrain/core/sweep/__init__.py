"""Hyperparameter sweeps: one pure policy over an Optuna study, two backends (local, operator)."""
