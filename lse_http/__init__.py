"""lse-server: LSE's OpenAI-compatible HTTP API (lse_http.app), a thin transport over lse_core.api,
and its command line (lse_http.server)."""
