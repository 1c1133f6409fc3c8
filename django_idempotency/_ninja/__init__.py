"""Django Ninja glue: protection installed on Ninja's operations.

``operations`` puts the protection inside a Ninja operation, after Ninja's
authentication, throttles and input validation; ``answers`` says Ninja's
way what a refused request gets; ``schema`` adds the header and the
refusals to the operation's OpenAPI description; ``tenant`` names the
client from Ninja's authentication result; ``urls`` finds the operations
behind a URL (for the checks, the metrics and ``ATOMIC_REQUESTS``).
Private: ``django_idempotency.ninja`` is what users import. Its modules
import Django Ninja, so nothing imports them unless Ninja is installed;
but ``tenant``, which the middleware's keyless report uses to name a Ninja
client.
"""
