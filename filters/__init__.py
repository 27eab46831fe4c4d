"""Prompt and response filters: small units that score a record, then decide, with a reason.

A pipeline's filters are a plain list in config order, looked up in a literal registry dict (see
`filters.prompt.PROMPT_FILTERS` and `filters.response.RESPONSE_FILTERS`).
"""
