"""Real servers for tests and benchmarks (`openai_server`: an OpenAI-compatible server that injects faults)."""
