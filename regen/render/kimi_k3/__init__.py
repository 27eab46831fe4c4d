"""The Kimi-K3 conversation format (shared/docs/kimi-k3-format.md), as the target renders it.

Modules, in reading order:
    tokenizer.py   tiktoken from a local checkpoint dir (or the bundled test vocabulary), §4 pre-tokenization
    messages.py    message-level rules (§2): validation, tool calls, content parts
    format.py      a conversation -> labelled segments (§1-§3)
    renderer.py    segments -> token ids + per-assistant-message supervised spans (`KimiK3Renderer`)
    test_vocab.py  builds the bundled TEST vocabulary (control ids real, BPE ranks not Kimi's)
"""
