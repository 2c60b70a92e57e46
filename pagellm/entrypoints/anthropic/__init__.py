"""Anthropic's Messages API (`POST /v1/messages`) on the same server, over the chat
machinery: protocol.py maps the request, serving_messages.py serves it."""
