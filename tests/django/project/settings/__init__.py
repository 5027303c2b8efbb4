"""One settings module per database: sqlite, postgresql, postgresql_psycopg2, mariadb."""
