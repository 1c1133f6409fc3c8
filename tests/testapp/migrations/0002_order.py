from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("testapp", "0001_create_charge"),
    ]

    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("number", models.CharField(max_length=64, unique=True)),
                ("amount", models.IntegerField()),
            ],
        ),
    ]
