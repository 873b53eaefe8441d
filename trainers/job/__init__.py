"""`agentrl train`: a recipe (`TrainJob`) → warm starts → held-out evaluation → the method's RL stage → held-out
evaluation, with a summary, plots and the resolved job on disk."""
