"""The `openai` client against `pagellm serve`: a chat completion, then one streamed.

    pagellm serve &                      # http://127.0.0.1:8000/v1
    python examples/openai_chat_client.py

OPENAI_BASE_URL and OPENAI_API_KEY point it at another server.
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
)
messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def main() -> None:
    model = client.models.list().data[0].id

    response = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    print(f"Assistant: {response.choices[0].message.content}")

    print("Streamed: ", end="")
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
