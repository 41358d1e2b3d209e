"""Ready-to-run locustfile: `locust -f servprof/harness/locustfile.py -H http://HOST:PORT`.

Options: `python -m servprof.harness --help` (locust's own `--help` is printed before a locustfile
is imported, so it does not list them), and in the web UI.
"""

from servprof.harness.users import OpenAIUser


class LLMUser(OpenAIUser):
    """One OpenAI-compatible client; all behaviour comes from the harness options."""
