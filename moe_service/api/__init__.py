"""The agent-facing parts of the OpenAI API, kept out of moe_service.server.

- :mod:`~moe_service.api.grammar`: token-level constrained decoding (llguidance);
- :mod:`~moe_service.api.tools`: tool-call formats per model family, prompts and parsers;
- :mod:`~moe_service.api.chat`: chat requests with tools / reasoning / response_format turned
  into a prompt and a constraint, and the model's output turned back into an OpenAI message;
- :mod:`~moe_service.api.logprobs`: logprobs in the OpenAI shapes;
- :mod:`~moe_service.api.auth`: API keys, Content-Type, Host allow-list and CORS.
"""
