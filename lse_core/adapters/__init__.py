"""The other APIs clients speak (OpenAI Responses, Anthropic Messages), each a thin adapter over the one
core request: it turns its body into a chat-completions body, and the core's streamed chunks into its own
response and stream shapes. Limits, thinking levels, sampling defaults, tool calls, context_full and
fallback warnings are decided by the core, never here."""
