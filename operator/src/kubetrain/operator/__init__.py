"""kubetrain.operator: the kopf operator that reconciles TrainingJobs. Never imports torch."""
