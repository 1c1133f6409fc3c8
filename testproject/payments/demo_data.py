"""The demo users and their fixed API tokens (public: demo use only).

Plain constants without Django imports, so that ``demo.py`` can read them
without setting Django up.
"""

DEMO_TOKENS = {
    # DRF tokens are 40 characters.
    "alice": "a11ce0000000000000000000000000000000demo",
    "bob": "b0b000000000000000000000000000000000demo",
}
ADMIN_USERNAME = "admin"
ADMIN_PASSWORD = "admin"
