"""What actors and learner share: wire protocol, config, model, tokenizer, tasks, weights, transport."""
