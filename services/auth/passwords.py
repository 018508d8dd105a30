"""Password hashing and the account input policy.

Passwords are stored only as argon2id hashes: a memory-hard KDF makes offline
guessing from a stolen database expensive on GPUs. The defaults are OWASP's
minimum recommendation (t=2, m=19 MiB, p=1); deployments can raise them, and
hashes made with older parameters are upgraded at the next successful login.
"""

from __future__ import annotations

import re
import secrets

from argon2 import PasswordHasher, Type
from argon2.exceptions import InvalidHashError, VerificationError

from nebula_common.errors import InvalidRequestError

DEFAULT_TIME_COST = 2
DEFAULT_MEMORY_COST_KIB = 19456
DEFAULT_PARALLELISM = 1

MIN_PASSWORD_LENGTH = 12
MAX_PASSWORD_LENGTH = 1024
"""Upper bound so a request cannot make the server hash megabytes of input."""

USERNAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{2,63}")
ROLES = frozenset({"admin", "user"})


def make_hasher(
    time_cost: int = DEFAULT_TIME_COST,
    memory_cost_kib: int = DEFAULT_MEMORY_COST_KIB,
    parallelism: int = DEFAULT_PARALLELISM,
) -> PasswordHasher:
    """An argon2id hasher with the given cost parameters."""
    return PasswordHasher(
        time_cost=time_cost, memory_cost=memory_cost_kib, parallelism=parallelism, type=Type.ID
    )


DEFAULT_HASHER = make_hasher()


def hash_password(password: str, hasher: PasswordHasher = DEFAULT_HASHER) -> str:
    """Hash with a fresh random salt; the result encodes algorithm, parameters and salt."""
    return hasher.hash(password)


def verify_password(password_hash: str, password: str, hasher: PasswordHasher = DEFAULT_HASHER) -> bool:
    """True when ``password`` matches; the comparison is constant-time inside argon2."""
    try:
        return hasher.verify(password_hash, password)
    except (VerificationError, InvalidHashError):
        return False


def needs_rehash(password_hash: str, hasher: PasswordHasher = DEFAULT_HASHER) -> bool:
    """True when the hash was made with other parameters than ``hasher`` uses now."""
    try:
        return hasher.check_needs_rehash(password_hash)
    except InvalidHashError:
        return True


class DummyHash:
    """A hash of a random secret, verified for unknown users so they take as long as known ones.

    Without it a failed login for a non-existent account would return in
    microseconds instead of tens of milliseconds, revealing which names exist.
    """

    def __init__(self, hasher: PasswordHasher = DEFAULT_HASHER) -> None:
        # Computed up front: hashing lazily would make the first unknown-user login measurably slower.
        self._hasher = hasher
        self._hash = hasher.hash(secrets.token_urlsafe(32))

    def verify(self, password: str) -> bool:
        """Spend the same work as a real verification; always False."""
        verify_password(self._hash, password, self._hasher)
        return False


def validate_username(username: str) -> None:
    if not USERNAME_PATTERN.fullmatch(username):
        raise InvalidRequestError(
            "username must be 3-64 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit"
        )


def validate_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise InvalidRequestError(f"password must be at least {MIN_PASSWORD_LENGTH} characters")
    if len(password) > MAX_PASSWORD_LENGTH:
        raise InvalidRequestError(f"password must be at most {MAX_PASSWORD_LENGTH} characters")


def validate_role(role: str) -> None:
    if role not in ROLES:
        raise InvalidRequestError(f"role must be one of {', '.join(sorted(ROLES))}, got {role!r}")


def validate_new_account(username: str, password: str, role: str) -> None:
    """Apply the whole account policy; the error message names the offending field."""
    validate_username(username)
    validate_password(password)
    validate_role(role)
