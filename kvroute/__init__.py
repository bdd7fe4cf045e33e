"""kvroute: an OpenAI-compatible router in front of several inferd workers, sending each request to its KV.

A session goes to the worker that holds it (a directory kept in the cluster
store, so every kvroute agrees); a request without one goes to the worker its
prompt's leading text hashes to, unless that worker is busier than the least
loaded by more than a bound; a worker that fails is taken out at once and its
sessions' KV comes from the store on the worker that takes them.
"""
