"""Helpers shared by the tests: GGUF factories and fuzzing, fake hosts (sysfs trees) and fake
serving engines, float64 references of the architectures, the SmolLM2 locator, a datagram sink."""
