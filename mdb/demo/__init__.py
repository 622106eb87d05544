"""The demo domain: users with pay accounts, addresses, orders and transactions.

It is the worked example of the docs and the data of ``mdb demo``.
"""
