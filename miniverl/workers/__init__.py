"""The roles, one module each (verl's names): rollout/ (generate_sequences), teacher
(compute_teacher_log_prob), actor (update_actor); logprobs and losses they compute with; factory
builds a run's roles. Each takes the Batch and returns it with its own columns filled."""
