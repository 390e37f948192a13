"""The PostgreSQL edition of both articles: article1.sql, article7.sql, their harness and tests."""
