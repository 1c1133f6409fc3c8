from django.apps import AppConfig


class UuidUserConfig(AppConfig):
    name = "tests.configurations.uuid_user"
    label = "uuid_user"
