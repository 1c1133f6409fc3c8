"""A custom user model with a UUID primary key (configuration ``uuid-user``)."""
