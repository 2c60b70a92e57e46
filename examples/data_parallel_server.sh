#!/usr/bin/env bash
# A data-parallel server: one engine-core process per rank (each with its own copy of
# the model and KV cache), one HTTP front end that balances requests between them.
# Any client works unchanged, e.g. examples/openai_chat_client.py.
#
#   bash examples/data_parallel_server.sh            # 2 ranks on port 8000
#   DP=4 PORT=9000 bash examples/data_parallel_server.sh --max-model-len 2048
#
# On a CPU the ranks share its cores (PAGELLM_NUM_THREADS defaults to cores / ranks).
set -euo pipefail
exec pagellm serve --data-parallel-size "${DP:-2}" --port "${PORT:-8000}" "$@"
