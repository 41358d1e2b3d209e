"""Ready-to-run locustfile: `locust -f servprof/harness/locustfile.py -H http://HOST:PORT`.

Options: `locust -f servprof/harness/locustfile.py --help` (group "servprof harness").
"""

from servprof.harness.users import OpenAIUser


class LLMUser(OpenAIUser):
    """One OpenAI-compatible client; all behaviour comes from the harness options."""
