"""The RL methods, one module each: what a recipe's table chooses (`agentrl.trainers.job.methods.METHODS`)."""
