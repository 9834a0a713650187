"""Model code: the target LLM, the DFlash drafter, their configs and checkpoint loading."""
