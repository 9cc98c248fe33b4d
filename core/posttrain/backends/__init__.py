"""What backends share: model and tokenizer loading, torch and process-group plumbing, exported
weight files, and the built-in reference backend ``hf_infer``."""
