"""The `lse` command: ask the model (one prompt, or an interactive chat), or show a server's status."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from typing import Any

from lse_core.config import DEFAULT_DRAFT_MAX, SPEC_TYPES, LSEConfig

SAMPLING_FLAGS = {  # flag -> request field
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "presence_penalty": "presence_penalty", "repeat_penalty": "repetition_penalty", "seed": "seed",
}


def add_engine_options(p: argparse.ArgumentParser, many_models: bool = False) -> None:
    """Options the CLI and lse-server share; ``many_models``: -m may be repeated (lse-server)."""
    if many_models:
        p.add_argument("-m", "--model", action="append", default=[], dest="models",
                       help="a Hugging Face model directory or a .gguf file; repeat it to serve several "
                            "(default: SmolLM2-135M)")
    else:
        p.add_argument("-m", "--model", help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M)")
    p.add_argument("--kv-len", type=int, default=0,
                   help="context length in tokens (default: the model's, at most 4096)")
    p.add_argument("--pool", help="devices, e.g. gpu:0 or opencl:0,cpu:0 (default: the devices that come up)")
    p.add_argument("--no-cpu-fallback", action="store_true", help="refuse to run any operation on the CPU interpreter")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a request's output does not depend on prefix caching or on the "
                        "requests it runs with (slower; backends that cannot refuse to start)")
    for part in ("k", "v"):
        p.add_argument(f"--cache-type-{part}", metavar="TYPE",
                       help=f"what the KV cache stores {'keys' if part == 'k' else 'values'} as: f16, q8_0 or f32 "
                            "(default: f16, or f32 on a device without f16, which startup reports)")
    p.add_argument("--spec-type", choices=SPEC_TYPES, default="none",
                   help="speculative decoding: ngram proposes the tokens that followed the reply's latest n-gram "
                        "where it stands earlier in the prompt or reply, and one step checks them all (default: none)")
    p.add_argument("--draft-max", type=_count, default=DEFAULT_DRAFT_MAX, metavar="N",
                   help=f"most tokens proposed per step (default: {DEFAULT_DRAFT_MAX})")
    p.add_argument("--draft-min", type=_count, default=0, metavar="N",
                   help="a proposal of fewer tokens is not made (default: 0)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def config_from_args(args: argparse.Namespace, **extra: Any) -> LSEConfig:
    """The options as an LSEConfig; options that contradict each other end the program with the reason."""
    try:
        return _config(args, **extra)
    except ValueError as e:
        raise SystemExit(f"{sys.argv[0].rsplit('/', 1)[-1]}: {e}") from None


def _config(args: argparse.Namespace, **extra: Any) -> LSEConfig:
    return LSEConfig(model=getattr(args, "model", None), kv_len=args.kv_len, pool=args.pool,
                     disable_cpu_fallback=args.no_cpu_fallback, deterministic=args.deterministic,
                     cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, spec_type=args.spec_type,
                     draft_max=args.draft_max, draft_min=args.draft_min, **extra)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
    p = argparse.ArgumentParser(prog="lse", description="Ask a language model, on whatever devices this machine has. "
                                "`lse status` shows a running lse-server.")
    p.add_argument("-p", "--prompt", help="the prompt (a chat turn; --raw for a plain completion)")
    p.add_argument("--raw", action="store_true", help="complete the prompt as plain text, without the chat template")
    p.add_argument("-s", "--system", help="a system message for chat turns")
    p.add_argument("-n", "--max-tokens", type=int, help="most tokens in the reply (default: no limit but the context)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--reasoning-effort", help="a thinking level the model's template defines (see lse_model_info)")
    add_engine_options(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)

    from lse_core.api import lse_close, lse_open_or_raise
    from lse_core.errors import StartupError

    try:
        lse = lse_open_or_raise(config_from_args(args, parallel=1))
    except StartupError as e:
        print(f"lse: {e}", file=sys.stderr)
        return 1
    try:
        fields: dict[str, Any] = {SAMPLING_FLAGS[k]: v for k, v in vars(args).items()
                                  if k in SAMPLING_FLAGS and v is not None}
        if args.max_tokens is not None:
            fields["max_tokens"] = args.max_tokens
        if args.reasoning_effort is not None:
            fields["reasoning_effort"] = args.reasoning_effort
        if args.prompt is None and sys.stdin.isatty():
            return chat_loop(lse, fields, args.system)
        prompt = args.prompt if args.prompt is not None else sys.stdin.read()
        if args.raw:
            return 0 if ask(lse, {"prompt": prompt, **fields}, "completion") is not None else 1
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        return 0 if ask(lse, {"messages": messages, **fields}, "chat") is not None else 1
    finally:
        lse_close(lse)


def ask(lse: Any, body: dict[str, Any], endpoint: str) -> str | None:
    """Stream one reply to the terminal; returns its content, or None after printing the error."""
    from lse_core.api import EVENT_ERROR, EVENT_TOKEN, lse_request_iter

    dim = sys.stdout.isatty()
    content = []
    in_reasoning = False
    for event in lse_request_iter(lse, {**body, "stream": True}, endpoint):
        if event.kind == EVENT_ERROR:
            print(f"\nlse: {event.data['error']['message']}", file=sys.stderr)
            return None
        if event.kind != EVENT_TOKEN:
            continue
        for choice in event.data.get("choices", []):
            delta = choice.get("delta", choice)
            reasoning, text = delta.get("reasoning_content") or "", delta.get("content") or delta.get("text") or ""
            if reasoning:
                if not in_reasoning and dim:
                    sys.stdout.write("\x1b[2m")
                in_reasoning = True
                sys.stdout.write(reasoning)
            if text:
                if in_reasoning:
                    sys.stdout.write("\x1b[0m\n" if dim else "\n")
                    in_reasoning = False
                sys.stdout.write(text)
                content.append(text)
            sys.stdout.flush()
    sys.stdout.write("\x1b[0m\n" if in_reasoning and dim else "\n")
    return "".join(content)


def chat_loop(lse: Any, fields: dict[str, Any], system: str | None) -> int:
    messages = [{"role": "system", "content": system}] if system else []
    print(f"lse: chatting with {lse.model_id}; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = ask(lse, {"messages": messages, **fields}, "chat")
        if reply is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": reply})


def status_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lse status", description="Show a running lse-server's status.")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default: %(default)s)")
    p.add_argument("--api-key", help="the server's --api-key, if it has one")
    p.add_argument("--json", action="store_true", help="print the raw lse_status JSON")
    args = p.parse_args(argv)
    request = urllib.request.Request(args.url.rstrip("/") + "/v1/lse/status")
    if args.api_key:
        request.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            status = json.load(r)
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"lse status: cannot read {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def format_status(status: dict[str, Any]) -> str:
    """lse_status as a readable table, one per model, then the replicas behind lse-server --replicas (lse_ray)."""
    tables = [_model_table(model) for model in status.get("models", [status])]
    if "replicas" in status:
        tables.append("\n".join([f"replicas ({len(status['replicas'])})",
                                 *(_replica_line(replica) for replica in status["replicas"])]))
    return "\n\n".join(tables)


def _model_table(status: dict[str, Any]) -> str:
    engine = status.get("engine", {})
    fb = engine.get("cpu_fallback", {})
    rows = [("model", status.get("model")), ("state", status.get("state", "loaded"))]
    if status.get("reason"):
        rows.append(("reason", status["reason"]))
    if status.get("memory_bytes") is not None:
        rows.append(("memory, load time", f"{status['memory_bytes'] >> 20} MiB, {status['load_s']:.1f} s"))
    if engine:
        rows += [("context length", status.get("context_length")),
                 ("devices", ", ".join(d["name"] for d in status.get("devices", []))),
                 ("KV cache (k / v)", ", ".join(f"{d['type_k']} / {d['type_v']} on {d['name']}"
                                                for d in status.get("kv_cache", {}).get("devices", []))),
                 ("running / waiting", f"{engine.get('running')} / {engine.get('waiting')}"),
                 ("free KV slots", f"{engine.get('free_slots')} of {engine.get('slots')}"),
                 ("engine steps", engine.get("steps")),
                 ("CPU fallback", f"{'allowed' if fb.get('allowed') else 'refused'}, {fb.get('total', 0)} so far")]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for event in fb.get("events", []):
        lines.append(f"{'':<{width}}  {event['count']:>8}  {event['cause']}")
    return "\n".join(lines)


def _replica_line(replica: dict[str, Any]) -> str:
    engine, stats = replica["engine"], replica["stats"]
    return (f"  {replica['replica']}  node {replica['node'][:12]}  pid {replica['pid']}  "
            f"{', '.join(d['name'] for d in replica['devices'])}  running {engine['running']} / waiting "
            f"{engine['waiting']}  free slots {engine['free_slots']} of {engine['slots']}  cached "
            f"{stats['cached_tokens']} of {stats['prompt_tokens']} prompt tokens  CPU fallback "
            f"{engine['cpu_fallback']['total']}")


if __name__ == "__main__":
    sys.exit(main())
