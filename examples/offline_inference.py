"""Offline batch inference: several prompts in one `LLM.generate` call (vLLM's basic
example; change the import to run it on vLLM).

    python examples/offline_inference.py
"""

from pagellm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Greedy; SamplingParams(temperature=0.8, top_p=0.95, seed=0) samples instead.
sampling_params = SamplingParams(temperature=0, max_tokens=32)


def main() -> None:
    llm = LLM()  # SmolLM2-135M-Instruct; LLM(model="path/to/model.gguf" or an HF directory)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}\n")


if __name__ == "__main__":
    main()
