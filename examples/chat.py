"""Chat offline: `LLM.chat` applies the model's chat template to a conversation (or a
batch of them) and continues it.

    python examples/chat.py
"""

from pagellm import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=48)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a haiku about the sea."},
    ]
    reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    print(f"Assistant: {reply}\n")

    # A batch: a list of conversations, one reply each, in order.
    questions = ["What is the capital of France?", "Name a prime number larger than 10."]
    batch = [[{"role": "user", "content": q}] for q in questions]
    for question, out in zip(questions, llm.chat(batch, params, use_tqdm=False)):
        print(f"User: {question}\nAssistant: {out.outputs[0].text}\n")


if __name__ == "__main__":
    main()
