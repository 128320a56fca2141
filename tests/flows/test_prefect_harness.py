def test_prefect_flow_runs_against_the_session_server(prefect_api):
    from prefect import flow, task

    @task
    def double(x: int) -> int:
        return 2 * x

    @flow
    def tiny(x: int) -> int:
        return double(x)

    assert tiny(21) == 42
