//! The budget slider: its logarithmic scale, its keys, the `/budget` it sends and the answer it
//! shows, a typed budget, and the config's budget asked for at start.

use super::*;

/// The `/budget` argument the slider sends for its position `step`.
fn gb_at(app: &App, step: u32) -> f64 {
    round_sig3(app.budget.bytes_at(step) as f64 / 1e9)
}

#[test]
fn the_budget_slider_scale_is_logarithmic_around_the_model() {
    let mut b = Budget::default();
    assert!(!b.ready());
    b.observe(MODEL_BYTES, None, 0);
    assert_eq!(b.bytes_at(0), MODEL_BYTES / 16);
    assert_eq!(b.bytes_at(BUDGET_STEPS), MODEL_BYTES / 4 * 5);
    assert_eq!(b.step, BUDGET_STEPS, "no budget: the knob sits at the top");
    for step in 0..=BUDGET_STEPS {
        assert_eq!(b.step_of(b.bytes_at(step)), step);
    }
    // A budget in force above what helps sits at the top, which stays where everything is
    // held; an untouched knob follows the budget in force.
    b.observe(MODEL_BYTES, Some(16_000_000_000), 0);
    assert_eq!(b.bytes_at(BUDGET_STEPS), MODEL_BYTES / 4 * 5);
    assert_eq!(b.step, BUDGET_STEPS);
    b.observe(MODEL_BYTES, Some(MODEL_BYTES / 2), 0);
    assert_eq!(b.step, b.step_of(MODEL_BYTES / 2));
    assert!(b.step > 0 && b.step < BUDGET_STEPS);
    // With the plan's floor known, the lowest position is the floor: nothing below it runs.
    b.observe(MODEL_BYTES, Some(MODEL_BYTES / 2), MODEL_BYTES / 5);
    assert_eq!(b.bytes_at(0), MODEL_BYTES / 5);
    assert_eq!(b.step_of(MODEL_BYTES / 100), 0);
    // A floor above what helps still leaves a range.
    b.observe(MODEL_BYTES, None, MODEL_BYTES * 2);
    assert_eq!(b.bytes_at(BUDGET_STEPS), MODEL_BYTES * 4);
}

#[test]
fn a_typed_budget_moves_the_slider() {
    let mut app = ready_app();
    with_figures(&mut app);
    type_text(&mut app, "/budget 2");
    let fx = act(&mut app, Action::Submit);
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Budget(2.0));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "budget 2.0 GB: 1 of 4 layers pinned".into(),
        },
    );
    assert_eq!(app.budget.step, app.budget.step_of(2_000_000_000));
    assert!(app.budget.step < BUDGET_STEPS);
}

#[test]
fn the_budget_slider_asks_the_engine_and_shows_its_answer() {
    let mut app = ready_app();
    // No figures yet: the slider cannot move.
    assert!(act(&mut app, Action::CharOr('[', Cmd::BudgetDown)).is_empty());
    with_figures(&mut app);
    assert!(app.budget.ready());
    assert_eq!(app.budget.in_force, None);
    assert_eq!(app.budget.step, BUDGET_STEPS);
    let fx = act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Budget(gb_at(&app, BUDGET_STEPS - 1)));
    // A second move while the first is in flight waits for its answer.
    assert!(act(&mut app, Action::CharOr('[', Cmd::BudgetDown)).is_empty());
    assert_eq!(app.budget.step, BUDGET_STEPS - 2);
    let fx = ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "/budget: below the floor".into(),
        },
    );
    // A refused value is not left on the slider: it goes back to the budget in force.
    assert!(fx.is_empty(), "{fx:?}");
    assert_eq!(app.budget.step, BUDGET_STEPS);
    assert!(
        matches!(&app.budget.answer, Some((b, Err(t))) if *b == app.budget.asked_at(BUDGET_STEPS - 1) && t.contains("floor"))
    );
    // The answer is not a conversation error.
    assert!(!has_error(&app, "floor"));
    act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    let fx = act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    assert!(fx.is_empty(), "one request at a time: {fx:?}");
    let fx = ev(
        &mut app,
        EngineEvent::Notice {
            turn: turn + 1,
            text: "budget 4.5 GB".into(),
        },
    );
    let (turn2, cmd2) = command(&fx);
    assert_eq!(cmd2, Command::Budget(gb_at(&app, BUDGET_STEPS - 2)));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn: turn2,
            text: "budget 4.1 GB: 3 of 4 layers pinned".into(),
        },
    );
    assert!(app.budget.asked.is_none());
    assert!(matches!(&app.budget.answer, Some((_, Ok(t))) if t.starts_with("budget 4.1 GB")));
    // The engine's figures report the new budget; the knob stays where the user put it, and
    // the slider, "in force" and the engine's answer are one number.
    let asked = app.budget.asked_at(BUDGET_STEPS - 2);
    assert_eq!(app.budget.value_bytes(), asked);
    assert_eq!(app.budget.in_force, Some(asked));
    let mut s = stats(0, 0.0);
    s.budget_bytes = Some(asked);
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(s),
        },
    );
    assert_eq!(app.budget.in_force, Some(asked));
    assert_eq!(app.budget.value_bytes(), asked);
    assert_eq!(app.budget.step, BUDGET_STEPS - 2);
    // The mouse sets it directly; a bracket with text in the input box is typed instead.
    let fx = act(&mut app, Action::BudgetAt(0.5));
    assert_eq!(
        command(&fx).1,
        Command::Budget(gb_at(&app, BUDGET_STEPS / 2))
    );
    type_text(&mut app, "a");
    assert!(act(&mut app, Action::CharOr(']', Cmd::BudgetUp)).is_empty());
    assert_eq!(app.input.text(), "a]");
}

#[test]
fn the_budget_slider_has_keys_when_focused() {
    let mut app = ready_app();
    with_figures(&mut app);
    act(&mut app, Action::Cmd(Cmd::Focus));
    assert_eq!(app.focus, Focus::Budget);
    let fx = act(&mut app, Action::Left);
    assert_eq!(
        command(&fx).1,
        Command::Budget(gb_at(&app, BUDGET_STEPS - 1))
    );
    assert_eq!(app.budget.step, BUDGET_STEPS - 1);
    act(&mut app, Action::Cmd(Cmd::Stop));
    assert_eq!(app.focus, Focus::Input);
}

#[test]
fn a_budget_from_the_config_is_asked_for_at_start() {
    let mut app = App::new(AppInit {
        budget_gb: Some(24.0),
        ..init()
    });
    let fx = ev(
        &mut app,
        EngineEvent::Ready {
            info: "k3: x, session \"a\", chat mode".into(),
        },
    );
    assert_eq!(command(&fx).1, Command::Budget(24.0));
}

#[test]
fn the_slider_shows_the_budget_in_force_exactly() {
    let mut app = ready_app();
    // The engine opened under a budget that is no slider step (80% of the memory, say).
    let mut s = stats(0, 0.0);
    s.budget_bytes = Some(1_234_567_890);
    s.floor_bytes = 300_000_000;
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(s),
        },
    );
    assert_eq!(app.budget.value_bytes(), 1_234_567_890);
    assert_eq!(app.budget.in_force, Some(1_234_567_890));
    // A move asks for the step's value to three digits, and that value is what the slider
    // shows while asked, and what is in force once the engine accepts it.
    let fx = act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    let (turn, cmd) = command(&fx);
    let Command::Budget(gb) = cmd else {
        panic!("{cmd:?}")
    };
    let asked = (gb * 1e9).round() as u64;
    assert_eq!(app.budget.value_bytes(), asked);
    // Figures sent before the answer (the old budget) do not move the knob back.
    let mut old = stats(0, 0.0);
    old.budget_bytes = Some(1_234_567_890);
    old.floor_bytes = 300_000_000;
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(old),
        },
    );
    assert_eq!(app.budget.value_bytes(), asked);
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: format!("budget {}: 1 of 4 layers pinned", short_bytes(asked)),
        },
    );
    assert_eq!(app.budget.in_force, Some(asked));
    assert_eq!(app.budget.value_bytes(), asked);
    // The engine's line names the same number the pane shows.
    let shown = short_bytes(app.budget.value_bytes());
    assert!(
        matches!(&app.budget.answer, Some((_, Ok(t))) if t.contains(&shown)),
        "{:?} vs {shown}",
        app.budget.answer
    );
}
