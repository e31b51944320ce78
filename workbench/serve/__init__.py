"""Deploy a run to a vLLM OpenAI-compatible endpoint, and talk to it.

    >>> ep = workbench.deploy(job)                        # doctest: +SKIP
    >>> ep.chat("What does a cow say?")                   # doctest: +SKIP
    'moo'
    >>> ep.stop()                                         # doctest: +SKIP

``deploy`` turns runs (a Job, a run id or name, an adapter or model folder, a base model id) into
one vLLM server: the base model with each run's LoRA adapter (``--enable-lora --lora-modules``),
or a run's merged weights (:func:`merge`), or a full fine-tune. It refuses what cannot work before
anything starts (missing adapter, rank above the server's max, port in use, no vLLM in the serving
Python, a head size the CPU backend cannot serve), then starts the server on the target through a
small guard process, waits for /health with progress, and records the endpoint in the registry.
vLLM lives in its own environment: the serving Python is ``python=``, else the run's
``serve.python``, else ``WORKBENCH_SERVE_PYTHON``, else ``.venv-serve`` next to the repo, else this
interpreter. An endpoint started from a kernel stops when that kernel ends unless ``keep=True``;
on other interfaces than loopback an API key is generated and required.

The modules follow the data, and this one re-exports their public names:

- :mod:`~workbench.serve.sources`: what to serve (a :class:`ServePlan`; :func:`merge`);
- :mod:`~workbench.serve.checks`: what is refused before anything starts;
- :mod:`~workbench.serve.target`, :mod:`~workbench.serve.targets`, :mod:`~workbench.serve.local`,
  :mod:`~workbench.serve.remote`, :mod:`~workbench.serve.ssh`, :mod:`~workbench.serve.slurm`:
  where it runs (this machine, an SSH host, a Slurm job);
- :mod:`~workbench.serve.server`, :mod:`~workbench.serve.guard`: the server process and its guard
  (``python -m workbench.serve --guard ...``; so no module here imports anything heavy at the top);
- :mod:`~workbench.serve.endpoint`: the endpoint handle, which acts only on its own deployment
  (:mod:`~workbench.serve.identity`); :mod:`~workbench.serve.deployment`: :func:`deploy`, which
  takes the data through all of them;
- :mod:`~workbench.serve.export_run` (:func:`export`), :mod:`~workbench.serve.gguf`,
  :mod:`~workbench.serve.export_ollama`, :mod:`~workbench.serve.modelcard`: taking the model home
  (merged weights, GGUF, an Ollama Modelfile, a model card), each checked by running it;
  :mod:`~workbench.serve.export_source` (what is exported, and where its weights are),
  :mod:`~workbench.serve.export_plan` (its disk, memory and time, before any work),
  :mod:`~workbench.serve.export_remote` and :mod:`~workbench.serve.export_host` (an export run
  on the SSH host or Slurm cluster that holds the weights);
- :mod:`~workbench.serve.metering`: endpoints paid block by block (a wallet's keeper, a course).
"""

from workbench.errors import (
    AdapterNotFoundError,
    DeployError,
    EndpointNotFoundError,
    EndpointReplacedError,
    EndpointStartError,
    ExportError,
    LoraRankError,
    PortInUseError,
    ServingEnvironmentError,
    UnsupportedModelError,
)
from workbench.serve.checks import (
    CPU_HEAD_SIZES,
    LORA_RANKS,
    check_head_size,
    check_lora_rank,
    check_port_free,
)
from workbench.serve.checks import _max_lora_rank as _max_lora_rank
from workbench.serve.deployment import LOOPBACK, deploy
from workbench.serve.endpoint import (
    LIVE_STATES,
    Endpoint,
    endpoints,
    endpoints_dir,
    endpoints_table,
    get_endpoint,
    refresh_state,
    undeploy,
)
from workbench.serve.export_run import ExportReport, export
from workbench.serve.guard import _guard_main as _guard_main
from workbench.serve.server import (
    PORT_FROM_GUARD,
    VLLM_MODULE,
    free_port,
    guard_command,
    vllm_command,
    vllm_env,
)
from workbench.serve.sources import Adapter, ServePlan, merge, merge_adapter, plan_serving
from workbench.serve.target import SERVE_ENV_HOW, ServeTarget, serving_python
from workbench.serve.targets import _on_cpu as _on_cpu
from workbench.serve.targets import get_serve_target, probe_serving_python

__all__ = [
    "CPU_HEAD_SIZES",
    "LIVE_STATES",
    "LOOPBACK",
    "LORA_RANKS",
    "PORT_FROM_GUARD",
    "SERVE_ENV_HOW",
    "VLLM_MODULE",
    "Adapter",
    "AdapterNotFoundError",
    "DeployError",
    "Endpoint",
    "EndpointNotFoundError",
    "EndpointReplacedError",
    "EndpointStartError",
    "ExportError",
    "ExportReport",
    "LoraRankError",
    "PortInUseError",
    "ServePlan",
    "ServeTarget",
    "ServingEnvironmentError",
    "UnsupportedModelError",
    "check_head_size",
    "check_lora_rank",
    "check_port_free",
    "deploy",
    "endpoints",
    "endpoints_dir",
    "endpoints_table",
    "export",
    "free_port",
    "get_endpoint",
    "get_serve_target",
    "guard_command",
    "merge",
    "merge_adapter",
    "plan_serving",
    "probe_serving_python",
    "refresh_state",
    "serving_python",
    "undeploy",
    "vllm_command",
    "vllm_env",
]
