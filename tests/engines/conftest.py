"""The engine plugin tests run where vLLM or SGLang is installed: a virtual environment of its own
per engine (their torch pins differ from ssu's test environment; .ci/run builds them from
.ci/engines/). Elsewhere they skip, saying so."""
