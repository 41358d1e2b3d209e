"""Replay LLM traffic against an OpenAI-compatible server with servprof's harness.

    locust -f bench/locustfile.py -H http://127.0.0.1:8000 --headless -u 16 -r 16 -t 60s \
        --arrival poisson --rate 4 --slo ttft=500,tpot=50 --csv out/run

See docs/readme-harness.md for every option. Your own locustfile can do the same:
subclass servprof.harness.OpenAIUser.
"""

from servprof.harness.users import OpenAIUser


class LLMUser(OpenAIUser):
    """One OpenAI-compatible client; all behaviour comes from the harness options."""
