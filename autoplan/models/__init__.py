"""Stage 1, the model: the zoo (configs and the plain single-device model code of each family), Hugging
Face configs, user factories, and `resolve_model`, which turns what the user named into a module on
the meta device."""
