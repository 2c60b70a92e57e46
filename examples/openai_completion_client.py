"""The `openai` client against `pagellm serve`: a completion, then the same streamed.

    pagellm serve &                      # http://127.0.0.1:8000/v1
    python examples/openai_completion_client.py

OPENAI_BASE_URL and OPENAI_API_KEY point it at another server (`pagellm serve
--api-key KEY` requires the key).
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),  # any string unless the server has --api-key
)


def main() -> None:
    model = client.models.list().data[0].id  # "SmolLM2-135M-Instruct"
    print(f"Model: {model}")

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0
    )
    print(f"Completion: {completion.choices[0].text!r}")
    print(f"Usage: {completion.usage.prompt_tokens} prompt + "
          f"{completion.usage.completion_tokens} completion tokens")

    print("Streamed: ", end="")
    for chunk in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0, stream=True
    ):
        print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
