"""An audit-log app, as audit and history packages write them (configuration ``delete-signals``).

Its ``ready()`` connects ``pre_delete`` and ``post_delete`` receivers without
a sender: from then on Django's ``QuerySet.delete()`` collects the rows with
a SELECT and deletes them by primary key, for every model in the project.
"""
